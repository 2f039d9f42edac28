"""The ``visionserve`` command. One subcommand per module; each module exposes
``add_arguments(parser)`` and ``run(args) -> int`` and imports nothing heavy at module level, so
that ``serve`` can pin the GPU (environment variables) before torch or onnxruntime load.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from . import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("visionserve.runtime.serve",
              "start the HTTP (and gRPC) server on a model repository"),
    # tooling: another package of the same wheel, imported only when the command runs
    "bench": ("visionserve_tools.bench",
              "measure served latency/throughput against the bare model"),
    "env": ("visionserve.ops.envrecord", "print the environment record (packages, CUDA, GPUs)"),
    "doctor": ("visionserve.ops.doctor", "diagnose GPU/driver/environment faults, with a fix each"),
    "stress": ("visionserve.ops.stress",
               "GPU health check: matmul throughput, memory pattern test"),
    "records": ("visionserve.records.cli",
                "traceability records: export (CSV, Parquet), show a part's history"),
    "guard": ("visionserve.guard.cli",
              "training-queue guard: run, submit, list, show, cancel, logs"),
    "users": ("visionserve.users.cli",
              "the console's users and their roles: add, list, remove, passwd, role"),
    "anomaly": ("visionserve_tools.anomaly",
                "anomaly models from good parts only: fit, evaluate"),
    "plc-sim": ("visionserve_tools.plcsim",
                "a PLC for tests and demos: OPC UA/Modbus results, acks, latency"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command; with ``only``, the modules of the others are not imported (their names and
    one-line help still list). A command whose top-level package is not installed (the tooling,
    in a runtime-only image) is left out."""
    parser = argparse.ArgumentParser(
        prog="visionserve",
        description="Low-latency batched inference server for industrial vision.",
    )
    parser.add_argument("--version", action="version", version=f"visionserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module_name.partition(".")[0]) is None:
            continue
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
