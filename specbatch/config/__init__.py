"""Every option declared once (``options``), and the speculation configuration the coordinator's
decode step gets (``speculation``). Torch-free."""
