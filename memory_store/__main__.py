"""``python -m memory_store``: manage the local Cassandra node that stores chat history."""

from __future__ import annotations

import sys


def main() -> None:
    sys.exit("memory_store: the local Cassandra node is not provisioned yet (see the memory_store issue).")


if __name__ == "__main__":
    main()
