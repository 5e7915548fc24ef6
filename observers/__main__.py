"""``python -m observers``: the headless CLI. The logic lives in ``lab.cli``; it is imported here,
inside the entry point, so importing the ``observers`` package never pulls in the app layer. The
process keeps the memory its tensors free (``lab.allocator``) from its first import on."""

import sys


def _main() -> int:
    from lab.allocator import keep_freed_memory

    keep_freed_memory()
    from lab.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(_main())
