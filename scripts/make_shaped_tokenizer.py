"""Write a synthetic tiktoken BPE file with a given number of ranks, for speed and memory runs
that need a real model's vocabulary size offline (scripts/gpu_check.sh: Llama 3's 128,000
ranks + 256 special tokens = 128,256).

    python scripts/make_shaped_tokenizer.py OUT [N_RANKS]

Ranks: the 256 single bytes, then every 2-byte string, then 3-byte strings, until N. Every
token is reachable by byte-pair merges, so text encodes to a mix of real ids; the statistics
are meaningless, the shapes are Llama 3's. An existing file with the same content is kept.
"""

from __future__ import annotations

import base64
import itertools
import sys
from pathlib import Path


def shaped_ranks(n: int) -> list[bytes]:
    if n < 256:
        raise ValueError(f"need at least the 256 single-byte ranks, got {n}")
    tokens = (bytes(t) for k in (1, 2, 3) for t in itertools.product(range(256), repeat=k))
    return list(itertools.islice(tokens, n))


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, n = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 128_000
    text = "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(shaped_ranks(n)))
    if not (out.is_file() and out.read_text() == text):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    print(f"{out}: {n:,} ranks (+256 Llama 3 special tokens in meshtrain)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
