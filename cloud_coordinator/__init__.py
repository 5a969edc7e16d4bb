"""cloud_coordinator: the Flower coordinator of a Fogline deployment.

Pure cores live in ``cloud_coordinator.aggregation`` (Byzantine-robust
aggregation rules, pre-aggregators and the stateful ``Aggregator`` the round
loop checkpoints) and ``cloud_coordinator.attacks`` (attacks shared by the
simulator and the robustness benchmark). Importing this package imports neither.
"""
