"""meshtrain entry point: `torchrun --nproc_per_node N train.py --config NAME [--section.key V]`.

`--help` lists every option; `--job.dry_run` builds the model on the meta device and reports
its size without launching. Everything else is in `training/`: the pre-launch checks in
`training/preflight.py`, the launch (logging, signals, the run) in `training/launch.py`.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from job_config import help_text
from training.launch import run


@record  # an uncaught exception goes to torchrun's error file too (see record_error)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
