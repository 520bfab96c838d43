"""The decode worker's step statistics (engine/cluster/conductor/step_stats.py): the heartbeat
takes the means since its last take, idle steps do not count."""

from __future__ import annotations

from engine.cluster.conductor.step_stats import StepMeans, StepStats


def test_means_since_the_last_take():
    s = StepStats()
    assert s.take() == StepMeans(0, 0.0, 0.0, 0.0)
    s.add(0.1, 2, 100)
    s.add(0.3, 4, 300)
    s.add(0.5, 0, 0)  # only loads in flight: no decode
    assert s.take() == StepMeans(2, 0.2, 3.0, 200.0)
    assert s.take().steps == 0  # taken: the next report starts afresh
