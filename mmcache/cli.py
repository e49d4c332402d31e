"""The ``mmcache`` command line.

    mmcache bench [NAME] [--json PATH] [NAME's options]   run benchmark NAME (without NAME: all of them, quick)
    mmcache replay TRACE ...                              replay a trace through metadata-only pools
    mmcache export-model PRESET DIR                       write an embedded model as a Hugging Face folder
    mmcache generate (--preset NAME | --model DIR) PROMPT ...   generate with the reference engine
    mmcache serve (--preset NAME | --model DIR) [--port 8000] ...   serve an OpenAI-compatible HTTP API

Subcommands live beside what they drive; each module listed in ``SUBCOMMANDS`` has ``register(subparsers)``,
which adds its parser and sets ``func``. A module that is not part of this install (a build without the
``benchmarks`` package) is skipped: its subcommands stay listed, and asking for one says on stderr that it is
not available and why, with exit code 2. Started as a program, the command first re-executes
itself on Intel's OpenMP runtime when that is installed (``mmcache.launcher.openmp``; ``MMCACHE_OPENMP=system`` keeps
the runtime torch ships with).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Callable

from .launcher import openmp
from .errors import MmcacheError


def count(maximum: int | None = None, minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number in ``[minimum, maximum]`` (a count: requests, runs, repeats,
    pages, tokens, threads, replicas; ``maximum`` None: no upper bound), so a bad value is refused with exit
    code 2 before anything is built or measured."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {n}")
        return n

    return parse


positive_int = count()
"""A whole number of at least 1 (``count()``)."""


def positive_ints(text: str) -> list[int]:
    """An argparse ``type`` for a comma-separated list of counts (``positive_int`` each)."""
    return [positive_int(part) for part in text.split(",")]


def writable(path: str | None, prog: str) -> bool:
    """Whether the output file ``path`` (None: none asked for; an empty path, as an unset variable gives, is
    refused) can be written, found out before a long run rather than after it: its folder is made, a temporary
    file beside it written and removed, the file itself not touched. When not, says so on stderr as
    ``prog: cannot write PATH: reason``."""
    if path is not None:
        try:
            if not path:
                raise FileNotFoundError(2, "empty path")
            if os.path.isdir(path):
                raise IsADirectoryError(21, "Is a directory")
            parent = os.path.dirname(os.path.abspath(path))
            above = parent
            while not os.path.exists(above):
                above = os.path.dirname(above)
            if not os.path.isdir(above):
                raise NotADirectoryError(20, f"{above} is not a folder")
            os.makedirs(parent, exist_ok=True)
            with open(f"{path}.part", "w"):
                pass
            os.remove(f"{path}.part")
        except OSError as e:
            print(f"{prog}: cannot write {path or repr(path)}: {e.strerror or e}", file=sys.stderr)
            return False
    return True


def write_json(path: str | None, result: dict, say: bool = True) -> None:
    """``result`` as JSON at ``path`` (nothing when None), replacing the file whole: a run stopped while it
    writes leaves the previous content, never a truncated one."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        part = f"{path}.part"
        with open(part, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        os.replace(part, path)
        if say:
            print(f"wrote {path}", file=sys.stderr)


SUBCOMMANDS = {"benchmarks.runner": ("bench",), "mmcache.replay.cli": ("replay",),
               "mmcache.engine.cli": ("export-model", "generate"),
               "mmcache.server.cli": ("serve",)}  # module: the subcommands it registers


def unavailable() -> dict[str, str]:
    """The subcommands whose module is not part of this install, each with why (the missing module)."""
    missing = {}
    for name, commands in SUBCOMMANDS.items():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                missing.update((command, f"module {e.name} is not installed") for command in commands)
                continue
            raise  # the module is there but a dependency of it is not: a broken install, shown in full
    return missing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    missing = unavailable()
    for name, commands in SUBCOMMANDS.items():
        if commands[0] in missing:
            for command in commands:
                sub.add_parser(command, help=f"not available in this install ({missing[command]})")
        else:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # started as the program, not called: choose the OpenMP runtime first (mmcache.launcher.openmp)
        try:
            openmp.maybe_reexec(sys.argv[1:])
        except openmp.OpenMPConfigError as e:
            print(f"mmcache: {e}", file=sys.stderr)
            return 2
    missing = unavailable()
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)  # the top level takes no other option
    if command in missing:  # before parsing, whose refusal of the command's own options would hide why
        print(f"mmcache: {command} is not available in this install: {missing[command]}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MmcacheError as e:  # a typed error of this project (a model folder that does not load, a bad
        # setting): one line naming it, not a traceback
        print(f"mmcache {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
