"""The arguments every Python stage of ``scripts/gpu/check.sh`` takes (``--out DIR``, ``--device
cuda|cpu``) and its refusal to run ``--device cuda`` where torch sees no GPU; torch alone, so the
smoke stage can use it before cpshard is built."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--out`` and ``--device``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where the stage's JSON goes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | None:
    """The arguments, OUT created; None (after saying why) for ``--device cuda`` without a GPU."""
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no GPU (--device cpu runs the dry run)")
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    return args
