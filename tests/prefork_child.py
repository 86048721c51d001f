"""A module for tests/test_prefork.py to run in a zygote's child: ``python -m prefork_child OUT CODE``
writes what it sees to OUT, then exits with CODE, or waits for a signal when CODE is "wait"."""

import json
import os
import sys
import time

import torch

if __name__ == "__main__":
    out, code = sys.argv[1], sys.argv[2]
    seen = {"argv": sys.argv, "name": __name__, "color": os.environ.get("COLOR"), "threads": torch.get_num_threads(),
            "stdin": sys.stdin.read()}
    with open(out + ".tmp", "w") as file:
        json.dump(seen, file)
    os.replace(out + ".tmp", out)
    if code == "wait":
        time.sleep(600)
    raise SystemExit(int(code))
