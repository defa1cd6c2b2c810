"""Command-line options generated from config dataclasses (server/config.py), so a default lives in one place.

A field becomes `--its-name` (a trailing `_s` dropped: `announce_period_s` is `--announce-period`) unless its metadata
names a "flag". Its metadata gives the "help", a "parse" (one of PARSERS), "choices" and "metavar"; a bool field is a
switch (False by default) or, with "none_flag" (True by default), a `--no-...` switch; a field with "none_flag" and
another default gets both its option and the switch that sets it to None; a tuple field takes one or more values.
"""

from __future__ import annotations

import argparse
import dataclasses
import math


def _number(kind: type, low: float, *, above: bool, high: float = math.inf, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > low if above else value >= low) or not value <= high or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def parse_port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535 (0: any free port), got {value}")
    return value


def parse_ip(text: str) -> str:
    """An IPv4 or IPv6 address (as others dial it: no name to resolve)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address such as 192.0.2.10, got {text!r}") from None


def parse_edges(text: str) -> tuple[int, int]:
    """`A,B`: blocks a client keeps at the front and at the back (whole numbers of 0 or more)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected A,B: two whole numbers of 0 or more such as 1,1, got {text!r}")
    return int(parts[0]), int(parts[1])


def parse_verify(text: str) -> str:
    """A verification policy as client/config.py's VerifyPolicy reads it."""
    if text == "off":  # the default, parsed on every command line: the policy's module loads torch and hivemind
        return text
    from nesa_node.client.config import VerifyPolicy

    try:
        return str(VerifyPolicy.parse(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_verify_arg(parser: argparse.ArgumentParser) -> None:
    """--verify and --canaries, for the commands that run a client (generate, gateway)."""
    parser.add_argument(
        "--verify",
        type=parse_verify,
        default="off",
        metavar="POLICY",
        help='check the nodes\' outputs: "off" (default); "audit:P" (nodes sign a commitment per 32-token window, a '
        "fraction P of the windows is re-executed on other nodes, a node caught is banned and the generation run "
        'again); "canary:P" (after a generation each node of its chain is, with chance P, sent a known-answer canary '
        "(--canaries); a node failing two is banned and the generation run again; checks the only node of a span "
        'too); or "majority:N" (each span run by N disjoint nodes, a strict majority deciding; "majority:N@A:B" '
        "for the spans of blocks A:B only; costs N times their compute, and two colluding nodes of three still win)",
    )
    parser.add_argument(
        "--canaries",
        default=None,
        metavar="FILE",
        help="known answers for --verify canary:P (`nesa-node model canaries MODEL` writes them; default: the "
        "model folder's canaries.safetensors)",
    )


def add_privacy_args(parser: argparse.ArgumentParser) -> None:
    """--private-edges and --boundary-noise, for the commands that run a client (generate, gateway)."""
    parser.add_argument(
        "--private-edges",
        type=parse_edges,
        default=None,
        metavar="A,B",
        help="run the first A and the last B decoder blocks in this process as well as the embeddings and LM head: "
        "nodes serve only the middle and never see token ids or vocabulary-sized tensors. With public weights this "
        "hides little on its own: `nesa-node privacy-check` measures what it hides (default: nodes serve all blocks)",
    )
    parser.add_argument(
        "--boundary-noise",
        type=PARSERS["non_negative"],
        default=0.0,
        metavar="SIGMA",
        help="Gaussian noise on every hidden state leaving this process, SIGMA times each token's RMS; it costs "
        "output quality (privacy-check measures both; default 0)",
    )


PARSERS = {
    "port": parse_port,
    "ip": parse_ip,
    "positive": _number(float, 0, above=True, what="a finite number above 0"),
    "positive_int": _number(int, 0, above=True, what="a whole number above 0"),
    "non_negative": _number(float, 0, above=False, what="a finite number of 0 or more"),
    "non_negative_int": _number(int, 0, above=False, what="a whole number of 0 or more"),
    "fraction": _number(float, 0, above=True, high=1.0, what="a fraction in (0, 1]"),
}


def flag_of(field: dataclasses.Field) -> str:
    name = field.name[:-2] if field.name.endswith("_s") else field.name
    return field.metadata.get("flag") or "--" + name.replace("_", "-")


def _metavar(name: str, default, parse: str | None) -> str:
    """What the option's value is, for --help: S (seconds), MS, PORT, N, F (a fraction), X, PATH or TEXT."""
    if name.endswith("_s"):
        return "S"
    if name.endswith("_ms"):
        return "MS"
    if parse == "port":
        return "PORT"
    if parse == "fraction":
        return "F"
    if isinstance(default, int) and not isinstance(default, bool):
        return "N"
    if isinstance(default, float):
        return "X"
    return "PATH" if name.endswith(("_path", "_file", "_cache")) else "TEXT"


def add_config_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_class: type) -> None:
    """One option per field of `config_class` (see the module docstring); each writes the field's name."""
    for field in dataclasses.fields(config_class):
        metadata = field.metadata
        if "help" not in metadata:
            continue
        default = field.default
        none_flag = metadata.get("none_flag")
        if isinstance(default, bool):
            if default:
                flag, help_text = none_flag
                parser.add_argument(flag, dest=field.name, action="store_false", help=help_text)
            else:
                parser.add_argument(flag_of(field), dest=field.name, action="store_true", help=metadata["help"])
            continue
        options: dict = {"dest": field.name, "default": default, "help": metadata["help"]}
        if "parse" in metadata:
            options["type"] = PARSERS[metadata["parse"]]
        for key in ("choices", "metavar"):
            if key in metadata:
                options[key] = metadata[key]
        if "metavar" not in options and "choices" not in options:
            options["metavar"] = _metavar(field.name, default, metadata.get("parse"))
        if isinstance(default, tuple):
            options.update(nargs="+", default=list(default))
        elif default is not None and "type" not in options:
            options["type"] = type(default)
        if default not in (None, (), "") and not isinstance(default, tuple):
            options["help"] += f" (default {default})"
        parser.add_argument(flag_of(field), **options)
        if none_flag is not None:
            flag, help_text = none_flag
            parser.add_argument(flag, dest=field.name, action="store_const", const=None, help=help_text)


def config_from_args(config_class: type, args: argparse.Namespace):
    """An instance of `config_class` from the parsed options add_config_options made."""
    values = {}
    for field in dataclasses.fields(config_class):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return config_class(**values)


__all__ = [
    "PARSERS",
    "add_config_options",
    "add_privacy_args",
    "add_verify_arg",
    "config_from_args",
    "flag_of",
    "parse_edges",
    "parse_port",
    "parse_verify",
]
