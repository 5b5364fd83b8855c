"""Run several `python -m dcinterp.synth` commands one after the other in one interpreter, each given as a JSON
list of its arguments; exit with the largest status. tests/test_distributed.py starts it under torchrun, so that
the two processes start once for every command; the process group is joined once, here, and each command uses it
(`distributed.start` leaves a group it did not create to its creator)."""

import json
import os
import sys

import torch.distributed as dist

from dcinterp.synth.__main__ import main

if __name__ == "__main__":
    shared = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if shared:
        dist.init_process_group("gloo")
    status = max(main(json.loads(arguments)) for arguments in sys.argv[1:])
    if shared:
        dist.destroy_process_group()
    sys.exit(status)
