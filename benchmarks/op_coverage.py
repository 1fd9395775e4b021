"""The op-coverage figure of the README: every op in the traces of the "models users bring" tier
(tests/distributed/users_models.py) and the link of the rule chain that places it.

    python benchmarks/op_coverage.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

from users_models import FAMILIES, batches  # noqa: E402

from usc.compiler.trace import trace  # noqa: E402
from usc.passes.derived_rules import rule_link  # noqa: E402


def ops_by_link() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        traced = trace(build(), batches(family, 1)[0])
        for node in traced.gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                found[rule_link(node.target)].add(str(node.target))
    return found


def main() -> None:
    found = ops_by_link()
    total = sum(len(ops) for ops in found.values())
    print(f"{len(FAMILIES)} models, {total} distinct aten ops in their traces")
    for link, count in Counter({k: len(v) for k, v in found.items()}).most_common():
        print(f"  {link:<17} {count:>3}  {', '.join(sorted(found[link])) if link != 'hand rule' else ''}")


if __name__ == "__main__":
    main()
