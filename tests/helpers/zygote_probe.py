"""Run through the zygote by tests/steps/test_zygote.py: reports what a forked child sees."""

import gc
import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    if sys.argv[1:2] == ["wait"]:
        def stop(signum, frame):
            print(json.dumps({"signal": signum}), flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        print("waiting", flush=True)
        # short sleeps: a signal that lands just before a long sleep's system call would wait it out
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(1)
    line = sys.stdin.readline().strip()
    print(json.dumps({"argv": sys.argv[1:], "probe": os.environ.get("ZYGOTE_PROBE"), "cwd": os.getcwd(),
                      "path0": sys.path[0], "stdin": line, "pid": os.getpid(), "ppid": os.getppid(),
                      "preloaded": "pyarrow" in sys.modules, "redis": "redis" in sys.modules, "frozen": gc.get_freeze_count(), "sys_path": sys.path,
                      "comm": open("/proc/self/comm").read().strip()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]))
