"""The house's limits, read from the source with `ast` (nothing is imported): no function over 120 lines,
no module over 500 lines, and imports at the top of a module. A function-local import stays only where
this file says why (HEAVY_OPTIONAL: a heavy optional library, by its name; LOCAL_IMPORTS: any other, by
(module, imported module)), and such imports are at most a tenth of the project's import statements.
An entry that no longer matches an import fails too: the lists say what is, not what was.

A backend's name (backends/registry.py BACKEND_NAMES, the one module imported) is written only in backends/:
elsewhere a module asks the backend (`backends.get_backend(name).<what it needs>`) or names it by the
registry's constants (backends.REFERENCE, DDP, DEEPSPEED, ...). A string equal to a backend's name stays
outside backends/ only where NAME_LITERALS says what else it means there (a launcher, a library, a CLI choice).

The project's code: every .py outside tests/, .venv, build, *.egg-info and hidden folders.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backends.registry import BACKEND_NAMES
from conftest import REPO

MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 500
MAX_MAIN_LINES = 80  # a command line's main: parse, check, call, print; the work in functions of its own
MAX_LOCAL_SHARE = 0.10  # function-local import statements / all import statements

# Libraries a function imports where a run needs them: each costs seconds to import (or may not import at
# all) and only some runs use it. A module name here covers its submodules. Where one function imports
# and configures the library (named in the reason), the others reach it through that function's module
# or import its submodules after it.
HEAVY_OPTIONAL = {
    "deepspeed": "heavy optional (seconds; probes the accelerator): DeepSpeed runs only. "
                 "backends/deepspeed_support.py import_deepspeed presets the CPU accelerator and quiets it",
    "transformers": "heavy optional (~2 s): hf:, --model_name_or_path and tokenized text only. "
                    "models/hub.py import_transformers imports it quiet on every rank",
    "accelerate": "heavy optional (~0.7 s): --backend accelerate (backends/accelerate.py) and FSDP2's "
                  "empty pretrained model (models/pretrained.py) only",
    "datasets": "heavy optional (~2.5 s): --train_file / --dataset_name only. models/hub.py import_datasets "
                "says in one line where it is not installed",
    "huggingface_hub": "0.2 s and ~170 modules (its HTTP clients): only where the Hub is asked "
                       "(models/hub.py hub_unreachable, models/pretrained.py resolve_checkpoint)",
    "pyarrow": "datasets' column store, loaded with it: tokenized text only (models/text_data.py)",
    "torchvision": "optional and may not import at all (PyPI's wheels are CUDA builds; no CPU build matches "
                   "the pinned CPU torch): torchvision: models only (models/vision.py)",
    "submitit": "heavy optional: --executor slurm only (orchestration/slurm.py)",
    "wandb": "heavy optional: --tracker wandb only (training/trackers.py)",
    "torch.utils.tensorboard": "heavy optional (tensorboard): --tracker tensorboard only (training/trackers.py)",
    "matplotlib": "figures only: a command that draws none does not load it",
    "seaborn": "figures only: a command that draws none does not load it",
    "hjson": "DeepSpeed's own config parser, installed with it: read where DeepSpeed reads a file "
             "(backends/deepspeed_config.py)",
    "torch._dynamo": "the compiler stack (seconds to import): --compile only (backends/compile.py)",
    "torch._functorch": "the compiler stack (seconds to import): --compile only (backends/compile.py)",
}

# Strings equal to a backend's name outside backends/: (module, the string) -> what it names there instead.
_LAUNCHER = "the launcher that started this rank, read from its environment (Backend.launcher names the backend's)"
_LIBRARY = "a library's distribution name, for its installed version"
_CHOICE = "a CLI choice of core/config.py, below backends/ (core cannot ask them)"
NAME_LITERALS = {
    ("orchestration/launch.py", "deepspeed"): "the DeepSpeed launcher's executable (Backend.launcher's value)",
    ("core/dist.py", "deepspeed"): _LAUNCHER,
    ("core/dist.py", "accelerate"): _LAUNCHER,
    ("core/environment.py", "deepspeed"): _LIBRARY,
    ("core/environment.py", "accelerate"): _LIBRARY,
    ("analysis/plan/backend_costs.py", "deepspeed"): _LIBRARY,
    ("core/config.py", "fsdp"): f"{_CHOICE}: --accelerate_plugin, accelerate's own plugins",
    ("core/config.py", "deepspeed"): f"{_CHOICE}: --accelerate_plugin, accelerate's own plugins",
    ("core/config_checks.py", "deepspeed"): f"{_CHOICE}: --ckpt_impl, DeepSpeed's activation checkpointing",
    ("core/owned.py", "deepspeed"): "a checkpoint format's name, stored in every checkpoint's meta.json",
    ("analysis/project.py", "deepspeed"): "train.py's --deepspeed switch, a flag's name",
}

# Any other function-local import: (the importing module's path, the imported module) -> why it is not at
# the top.
_DCP = "torch.distributed.checkpoint: 2 s and ~700 modules to import; only a DCP checkpoint needs it"
_TORCH_FREE = ("torch (seconds): importing orchestration stays torch-free (`sweep.py --help`, a Slurm job "
               "unpickling its SweepRun); torch loads with a backend's module, where a run's command is built")
LOCAL_IMPORTS = {
    ("backends/ddp_zero1.py", "torch.distributed.optim"): "0.8 s (it scripts torch's functional optimizers, with "
                                                          "warnings): only a ddp_zero1 run builds one; the registry's "
                                                          "questions import every backend's module",
    ("models/pretrained.py", "torch.distributed.checkpoint"): _DCP,
    ("training/checkpoint.py", "torch.distributed.checkpoint"): _DCP,
    ("training/export.py", "torch.distributed.checkpoint.format_utils"): _DCP,
    ("training/export.py", "backends.deepspeed"): "DeepSpeed's own checkpoints only: exporting another backend's never "
                                                  "loads DeepSpeed",
    ("training/export.py", "backends.deepspeed_support"): "DeepSpeed's own checkpoints only (import_deepspeed)",
    ("analysis/runs.py", "analysis.compact"): "`python -m analysis.compact` runs that module as __main__: imported by "
                                              "the package first, it would be loaded twice (runpy warns)",
    ("backends/__init__.py", "backends"): "torch: the registry's names are read torch-free (a sweep)",
    ("backends/deepspeed_config.py", "backends"): _TORCH_FREE,
    ("orchestration/sweep.py", "core.config"): _TORCH_FREE,
    ("orchestration/sweep.py", "gptlite.model"): _TORCH_FREE,
    ("orchestration/sweep.py", "models.spec"): _TORCH_FREE,
    ("orchestration/sweep.py", "backends"): _TORCH_FREE,
}

@dataclass(frozen=True)
class LocalImport:
    path: str  # the importing module, relative to the repository
    line: int
    module: str  # the imported module, absolute (`from . import x` resolved)
    text: str


@dataclass
class Shape:
    """One module's measures: its lines, its functions' lengths, its import statements."""

    lines: int
    functions: dict[str, int]  # qualified name (Class.method, outer.inner) -> lines, decorators aside
    top_statements: int  # import statements outside any function
    local_statements: int  # import statements inside a function
    local_imports: list[LocalImport]  # one per module a function-local statement imports
    strings: list[tuple[int, str]] = field(default_factory=list)  # (line, value) of every string constant


def project_files(root: Path) -> list[Path]:
    def counted(p: Path) -> bool:
        return not any(d in ("tests", ".venv", "build") or d.endswith(".egg-info") or d.startswith(".")
                       for d in p.relative_to(root).parts[:-1])

    return sorted(p for p in root.rglob("*.py") if counted(p))


def _imported(node: ast.Import | ast.ImportFrom, path: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = list(Path(path).with_suffix("").parts[:-1])  # a module's package; __init__'s is its folder
    base = package[: len(package) - node.level + 1] if node.level else []
    return [".".join([*base, *filter(None, [node.module])])]


def shape(source: str, path: str) -> Shape:
    """The measures of the module at `path` (relative to the repository) whose text is `source`."""
    measured = Shape(len(source.splitlines()), {}, 0, 0, [])

    def visit(node, scope: str, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{scope}{child.name}"
                measured.functions[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.", True)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{scope}{child.name}.", in_function)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and not in_function:
                measured.top_statements += 1
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                measured.local_statements += 1
                measured.local_imports += [LocalImport(path, child.lineno, m, ast.unparse(child))
                                           for m in _imported(child, path)]
            else:
                visit(child, scope, in_function)

    tree = ast.parse(source)
    visit(tree, "", False)
    measured.strings = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                        and isinstance(n.value, str)]
    return measured


def measure(root: Path) -> dict[str, Shape]:
    """Every project module under `root` by its path relative to `root`."""
    return {str(p.relative_to(root)): shape(p.read_text(), str(p.relative_to(root))) for p in project_files(root)}


def long_functions(shapes: dict[str, Shape]) -> dict[str, int]:
    return {f"{path}:{name}": n for path, s in shapes.items() for name, n in s.functions.items()
            if n > MAX_FUNCTION_LINES}


def long_mains(shapes: dict[str, Shape]) -> dict[str, int]:
    """A module's `main` (or `_main`) over MAX_MAIN_LINES."""
    return {f"{path}:{name}": n for path, s in shapes.items() for name, n in s.functions.items()
            if name in ("main", "_main") and n > MAX_MAIN_LINES}


def long_modules(shapes: dict[str, Shape]) -> dict[str, int]:
    return {path: s.lines for path, s in shapes.items() if s.lines > MAX_MODULE_LINES}


def _covers(name: str, module: str) -> bool:
    return module == name or module.startswith(f"{name}.")


def why_local(imp: LocalImport, heavy: dict, local: dict) -> str | None:
    """The allow-list's reason for a function-local import, or None where it names none."""
    return next((reason for name, reason in heavy.items() if _covers(name, imp.module)),
                local.get((imp.path, imp.module)))


def unnamed_imports(shapes: dict[str, Shape], heavy: dict, local: dict) -> list[LocalImport]:
    """The function-local imports the allow-list gives no reason for."""
    return [i for s in shapes.values() for i in s.local_imports if why_local(i, heavy, local) is None]


def stale_entries(shapes: dict[str, Shape], heavy: dict, local: dict) -> list:
    """Allow-list entries that match no function-local import."""
    imports = [i for s in shapes.values() for i in s.local_imports]
    return sorted(n for n in heavy if not any(_covers(n, i.module) for i in imports)) + \
        sorted(set(local) - {(i.path, i.module) for i in imports})


def local_share(shapes: dict[str, Shape]) -> float:
    local = sum(s.local_statements for s in shapes.values())
    return local / max(1, local + sum(s.top_statements for s in shapes.values()))


def name_literals(shapes: dict[str, Shape], names) -> list[tuple[str, int, str]]:
    """(module, line, string) of every string constant equal to one of `names` outside backends/."""
    return sorted((path, line, value) for path, s in shapes.items() if not path.startswith("backends/")
                  for line, value in s.strings if value in names)


def unexplained_literals(shapes: dict[str, Shape], names, allowed: dict) -> list[tuple[str, int, str]]:
    return [(path, line, value) for path, line, value in name_literals(shapes, names) if (path, value) not in allowed]


def stale_literals(shapes: dict[str, Shape], names, allowed: dict) -> list[tuple[str, str]]:
    return sorted(set(allowed) - {(path, value) for path, _, value in name_literals(shapes, names)})


@pytest.fixture(scope="module")
def shapes() -> dict[str, Shape]:
    return measure(REPO)


def test_the_project_is_measured(shapes):
    """The measure sees the project: its packages and scripts, not the tests or the environment."""
    assert {"train.py", "gptlite/model.py", "models/hub.py", "benchmarks/zoo_accuracy.py"} <= set(shapes)
    assert not any(p.startswith(("tests/", ".venv/")) for p in shapes)


def test_no_function_over_120_lines(shapes):
    assert long_functions(shapes) == {}


def test_no_main_over_80_lines(shapes):
    assert long_mains(shapes) == {}


def test_no_module_over_500_lines(shapes):
    assert long_modules(shapes) == {}


def test_every_function_local_import_is_named_with_its_reason(shapes):
    unnamed = unnamed_imports(shapes, HEAVY_OPTIONAL, LOCAL_IMPORTS)
    assert [f"{i.path}:{i.line} {i.text}" for i in unnamed] == []
    assert all(reason.strip() for reason in [*HEAVY_OPTIONAL.values(), *LOCAL_IMPORTS.values()])


def test_the_allow_list_has_no_stale_entry(shapes):
    assert stale_entries(shapes, HEAVY_OPTIONAL, LOCAL_IMPORTS) == []


def test_function_local_imports_are_at_most_a_tenth(shapes):
    assert local_share(shapes) <= MAX_LOCAL_SHARE


def test_no_backend_name_is_written_outside_backends(shapes):
    """Each backend answers for itself (Backend attributes), named by the registry's constants."""
    assert unexplained_literals(shapes, BACKEND_NAMES, NAME_LITERALS) == []


def test_the_name_allow_list_has_no_stale_entry(shapes):
    assert stale_literals(shapes, BACKEND_NAMES, NAME_LITERALS) == []


# ---------------------------------------------------------------------------------------- the checks can fail
def test_each_check_finds_what_it_is_for(tmp_path):
    """A synthetic project, measured as the project is: a function of 121 lines, a module of 501, a stray
    function-local import beside a heavy library's and a named pair's, an allow-list entry that matches
    nothing; files under tests/ and .venv are not the project's."""
    body = "\n".join(["        x = 1"] * 118)
    files = {
        "pkg/__init__.py": "",
        "pkg/mod.py": ("import os\nfrom . import sibling\n\n\ndef short():\n    import deepspeed.zero\n"
                       "    from .near import thing\n    return thing\n\n\nclass Holder:\n    def long(self):\n"
                       f"        import json, yaml\n{body}\n        return json\n"),
        "pkg/big.py": "x = 1\n" * 501,
        "pkg/fits.py": "x = 1\n" * 500,
        "tests/test_x.py": "def f():\n    import json\n" + "    x = 1\n" * 600,
        ".venv/lib/y.py": "x = 1\n" * 600,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    shapes = measure(tmp_path)
    assert sorted(shapes) == ["pkg/__init__.py", "pkg/big.py", "pkg/fits.py", "pkg/mod.py"]
    assert shapes["pkg/mod.py"].functions == {"short": 4, "Holder.long": 121}
    assert long_functions(shapes) == {"pkg/mod.py:Holder.long": 121}
    assert long_modules(shapes) == {"pkg/big.py": 501}
    assert long_mains({"m.py": Shape(90, {"main": 81, "Cls.main": 81, "helper": 100}, 0, 0, [])}) == {"m.py:main": 81}
    assert long_mains({"m.py": Shape(90, {"main": 80}, 0, 0, [])}) == {}
    heavy, local = {"deepspeed": "heavy", "wandb": "heavy"}, {("pkg/mod.py", "pkg.near"): "a circle"}
    assert [i.module for i in unnamed_imports(shapes, heavy, local)] == ["json", "yaml"]
    assert [i.module for i in unnamed_imports(shapes, {**heavy, "json": "r", "yaml": "r"}, local)] == []
    assert stale_entries(shapes, heavy, {**local, ("pkg/mod.py", "yaml"): "r", ("pkg/big.py", "json"): "r"}) == \
        ["wandb", ("pkg/big.py", "json")]
    assert local_share(shapes) == 3 / 5  # three function-local statements against two at the top


def test_the_name_check_finds_a_backend_name(tmp_path):
    """A synthetic project: a backend's name compared with, passed and keyed on outside backends/ is found
    (a docstring or a longer string naming it is not); backends/ and tests/ may write it; an allowed pair
    passes, and an allowed pair that matches nothing is stale."""
    files = {
        "pkg/sweep.py": ('"""Runs ddp, say."""\n\n\ndef world(backend):\n    return 1 if backend == "single" else 2\n'
                         '\n\nFLAGS = {"ddp": ["--backend", "ddp"]}\nLABEL = "ddp.bucket_25mb"\n'),
        "pkg/launch.py": 'LAUNCHERS = ("python", "torchrun", "deepspeed")\n',
        "backends/registry.py": 'NAMES = ("single", "ddp", "deepspeed")\n',
        "tests/test_x.py": 'BACKEND = "ddp"\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    shapes = measure(tmp_path)
    names = ("single", "ddp", "deepspeed")
    allowed = {("pkg/launch.py", "deepspeed"): "a launcher"}
    found = [("pkg/sweep.py", 5, "single"), ("pkg/sweep.py", 8, "ddp"), ("pkg/sweep.py", 8, "ddp")]
    assert unexplained_literals(shapes, names, allowed) == found
    assert unexplained_literals(shapes, names, {}) == [("pkg/launch.py", 1, "deepspeed"), *found]
    assert stale_literals(shapes, names, {**allowed, ("pkg/sweep.py", "deepspeed"): "r"}) == \
        [("pkg/sweep.py", "deepspeed")]
