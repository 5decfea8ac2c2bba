"""Several simulated worlds in one interpreter (simulation.fake_world.simulate, one after another), for
the tests that replay many runs: one process instead of one per replay.

    python tests/support/fake_world_batch.py CASES.json OUT.json

CASES.json: a list of [world, gpus_per_node, train.py flags]; OUT.json: the list of simulate()'s
results, in order. Each simulation makes and ends its own fake process group, as the CLI's does
(`python -m simulation.fake_world` runs one; tests/unit/test_fake_world.py runs that CLI for real too). At most
one DeepSpeed run per batch: DeepSpeed keeps its process groups in module globals, and a second
simulation found the first's group gone ("Group ... is not registered").
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from simulation.fake_world import check_train_flags, simulate  # noqa: E402


def main() -> None:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = []
    for world, per_node, flags in cases:
        check_train_flags(flags)
        results.append(simulate(world, per_node, flags))
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
