"""Counts the Python interpreters the test suite starts (tests/support/tiers.py).

The suite puts this directory first on PYTHONPATH, so every interpreter started under it imports this
module at start-up (Python's site hook) and appends one line, its pid and command line, to the file
GPTLITE_TEST_LAUNCH_LOG names. Outside the suite the variable is unset and this does nothing. One
O_APPEND write per line: concurrent ranks never interleave their lines.
"""

import os

_log = os.environ.get("GPTLITE_TEST_LAUNCH_LOG")
if _log:
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _cmd = _f.read().replace(b"\0", b" ").strip()[:300]
    except OSError:  # not Linux: the line still counts
        _cmd = b"?"
    try:
        _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_fd, b"%d %s\n" % (os.getpid(), _cmd.replace(b"\n", b" ")))
        os.close(_fd)
    except OSError:
        pass
