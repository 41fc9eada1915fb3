"""The thread chooser keeps the thread count with the lower measured step time."""

from __future__ import annotations

import torch

from tokenmill.train.threads import ThreadChooser


def test_chooser_switches_to_the_faster_count_after_a_probe():
    chooser = ThreadChooser(choices=(2, 1), probe_every=4)
    seconds = {2: 8.0, 1: 3.0}  # a loaded machine: the second thread only slows us down
    used = []
    try:
        for step in range(12):
            threads = chooser.threads_for_step(step)
            used.append(threads)
            chooser.record(seconds[threads], tokens=4096)
    finally:
        torch.set_num_threads(2)
    # Step 3 probes 1 thread and wins; later probes of 2 threads keep losing.
    assert used == [2, 2, 2, 1, 1, 1, 1, 2, 1, 1, 1, 2]
    assert chooser.current == 1
    assert chooser.steps_at == {2: 5, 1: 7}
