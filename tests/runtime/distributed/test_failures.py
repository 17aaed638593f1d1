"""The heartbeat in the rendezvous store: it moves while the rank lives, stops on `stop`, and lets the process end."""

from __future__ import annotations

import subprocess
import sys
import time

import torch.distributed as dist

from octavo.runtime.distributed.failures import HEARTBEAT_INTERVAL_S, Heartbeat

BEAT_AND_EXIT = """\
import datetime, time
import torch.distributed as dist
from octavo.runtime.distributed import failures

failures.HEARTBEAT_INTERVAL_S = 0.0  # a store call in flight at almost every instant
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10),
                      wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=datetime.timedelta(seconds=10))
heartbeat = failures.Heartbeat(client, 1)
time.sleep(0.1)
heartbeat.stop()
print(int(client.get("heartbeat/1")), flush=True)
"""


def test_the_counter_moves_until_stop_and_then_stands_still():
    store = dist.HashStore()
    heartbeat = Heartbeat(store, 3)
    time.sleep(HEARTBEAT_INTERVAL_S * 3)
    moving = int(store.get("heartbeat/3"))
    heartbeat.stop()
    stopped = int(store.get("heartbeat/3"))
    time.sleep(HEARTBEAT_INTERVAL_S * 2)
    assert moving >= 2
    assert int(store.get("heartbeat/3")) == stopped


def test_a_process_whose_heartbeat_was_stopped_exits_cleanly():
    """Without `stop`, a process that ends while the beating thread is inside a store call aborts
    ("terminate called without an active exception"): with the interval at 0 that is nearly every exit."""
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", BEAT_AND_EXIT], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert int(result.stdout) > 10, result.stdout

