"""What the draft and target services share: the cache calls over an engine, sequence leases, metrics and start-up."""
