"""The torch-free contract between the parts: refusals, sampling parameters, speculation limits, the profile document."""
