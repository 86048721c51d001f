"""The ``specbatch`` command and the tools beside it: up, generate, demo, bench, profile, distill,
the sampling benchmark, and the local stacks (processes or in-process) they start. The top floor:
these import the coordinator and both services; nothing below imports them."""
