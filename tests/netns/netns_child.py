"""Entry point of a NetnsChild (run under `ip netns exec`): connect back, run the target.

argv: socket path, "module:function"; stdin: repr() of the target's extra arguments."""

import ast
import importlib
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(TESTS.parent),
    str(TESTS / "kvtransfer"),
    str(TESTS / "e2e"),
    str(TESTS / "netns"),
]


def main() -> None:
    path, target = sys.argv[1], sys.argv[2]
    args = ast.literal_eval(sys.stdin.read())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    conn = Connection(sock.detach())
    module, fn = target.split(":")
    getattr(importlib.import_module(module), fn)(conn, *args)


if __name__ == "__main__":
    main()
