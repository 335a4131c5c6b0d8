"""The ``hf-sparsemax`` command.

    hf-sparsemax decoding-report --loss sparse_softmax --loss-option top_k=10 --prompt "Once upon a time"

``--model`` takes a model id or local folder (any causal LM transformers can
load; a ``.gguf`` file path works too) and defaults to the offline
SmolLM2-135M-Instruct. Errors in the arguments exit with code 2 and one line.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys


def parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def load_model(spec: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import assets

    if spec is None:
        return assets.load_smollm2()
    if spec.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(spec))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name), tokenizer
    return AutoModelForCausalLM.from_pretrained(spec), AutoTokenizer.from_pretrained(spec)


def decoding_report_command(args) -> int:
    from .generation import decoding_report
    from .patch import patch_model

    from .settings import SparseSettings

    options = dict(args.loss_option)
    SparseSettings(loss=args.loss, loss_options=options)  # bad names or options fail before the model loads
    model, tokenizer = load_model(args.model)
    if args.loss:
        patch_model(model, loss=args.loss, loss_options=options)
    decode = dict(args.decode_option)
    report = decoding_report(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                             matched=not decode, seed=args.seed, **decode)
    report.pop("per_token")
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sparsemax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("decoding-report", help="how far sampling strays from the trained distribution")
    report.add_argument("--model", help="model id, folder or .gguf file (default: offline SmolLM2-135M-Instruct)")
    report.add_argument("--loss", help="the training loss whose distribution decoding should match")
    report.add_argument("--loss-option", type=parse_option, action="append", default=[], metavar="NAME=VALUE")
    report.add_argument("--decode-option", type=parse_option, action="append", default=[], metavar="NAME=VALUE",
                        help="decode with plain transformers sampling and these generate options instead")
    report.add_argument("--prompt", action="append", required=True)
    report.add_argument("--max-new-tokens", type=int, default=32)
    report.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        return decoding_report_command(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"hf-sparsemax: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
