"""Floor 11, the top: the `appo` command line. A registry of subcommands, each in its own module, imported only when used.

Every subcommand module exposes `main(argv: list[str]) -> int` and parses its own arguments, so
`appo --help` stays instant (no torch import) and a new command is one file plus one registry line.
A configuration mistake (`appo_trl.configs.errors.ConfigError`) prints one line and exits 2; `--debug` anywhere on
the command line shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Keep alphabetical within each group.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("appo_trl.cli.train", "RL training (GRPO / ARPO / AEPO / APPO) from a YAML recipe"),
    "sft": ("appo_trl.cli.sft", "SFT cold start from a YAML recipe (TRL SFTTrainer)"),
    "eval": ("appo_trl.cli.eval", "tool-integrated evaluation with pass@k, judge and reports"),
    "demo": ("appo_trl.cli.demo", "tiny tool-using agent on CPU: SFT, eval, APPO with python + search, eval again"),
    "study": ("appo_trl.cli.study", "GRPO vs ARPO vs AEPO vs APPO from one SFT checkpoint, several seeds, on CPU"),
    "plot": ("appo_trl.cli.plot", "training curves (reward, accuracy, tool calls, branches, step time) to a PNG"),
    "rollouts": ("appo_trl.cli.rollouts", "sample trajectories of a run as branch trees (needs --dump_rollouts)"),
    "tool": ("appo_trl.cli.tool", "run one tool call (python sandbox or search) and print JSON"),
    "serve-search": ("appo_trl.cli.serve_search", "local BM25 retriever server (Search-R1 /retrieve protocol)"),
    "tiny-model": ("appo_trl.cli.tiny_model", "build a tiny random Qwen3 model + tokenizer, offline"),
    "env": ("appo_trl.cli.env", "print versions of the stack (like `trl env`)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: appo <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `appo <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from appo_trl import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        print(f"appo: unknown command {name!r}.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    from appo_trl.configs.errors import run_cli

    module = importlib.import_module(COMMANDS[name][0])
    return run_cli(f"appo {name}", module.main, rest)  # configuration errors: one line, exit 2 (--debug: traceback)


if __name__ == "__main__":
    sys.exit(main())
