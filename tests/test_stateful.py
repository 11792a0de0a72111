"""The Cython core against the pure-Python model (hypothesis stateful tests)."""
from hypothesis import HealthCheck, settings

from core_machines import PoolMachine, SlidingTablesMachine, TablesMachine
from state_machines import StateCacheMachine, TieredStateMachine

_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestPoolAgainstModel = PoolMachine.TestCase
TestPoolAgainstModel.settings = _settings

TestTablesAgainstModel = TablesMachine.TestCase
TestTablesAgainstModel.settings = settings(_settings, max_examples=80)

TestSlidingTablesAgainstModel = SlidingTablesMachine.TestCase
TestSlidingTablesAgainstModel.settings = settings(_settings, max_examples=80)

TestStateCacheAgainstModel = StateCacheMachine.TestCase
TestStateCacheAgainstModel.settings = settings(_settings, max_examples=60)

TestTieredStatesAgainstModel = TieredStateMachine.TestCase
TestTieredStatesAgainstModel.settings = settings(_settings, max_examples=40)
