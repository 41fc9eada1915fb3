"""The command line builds only the command it runs."""

import subprocess
import sys

from tokenmill import cli


def test_a_command_loads_only_its_own_module_and_the_overview_lists_every_command():
    # A fresh interpreter: this process has the server's modules loaded by other tests.
    code = ("import sys; from tokenmill.cli import build_parser; "
            "args = build_parser('generate').parse_args(['generate', '--model', 'm', "
            "'--prompt', 'p']); "
            "print(args.command, 'fastapi' in sys.modules, 'tokenmill.bench.tune' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["generate", "False", "False"]
    overview = cli.build_parser().format_help()
    for command in (*cli.COMMANDS, "train"):
        assert command in overview
    assert cli.build_parser("serve").parse_args(["serve", "--port", "9"]).port == 9
