"""The site bridge with fault injection, for tests and demos of a Byzantine site (never production).

The production bridge (``cloud_coordinator.site_aggregator.bridge``) has no fault hook, so the
coordinator does not import the edge agent. A test that wants a site to lie starts the coordinator
with ``fogline coordinator --hierarchical --site-bridge simulations.faulty_bridge:app`` and the site's
aggregator with ``--cloud-node-config byzantine=MODE``: the same train and evaluate handlers, with
``edge_agent.flower_client.simulated_faults`` falsifying the site's replies.
"""
from __future__ import annotations

from flwr.clientapp import ClientApp

from cloud_coordinator.site_aggregator.bridge import evaluate, train
from edge_agent.flower_client import simulated_faults

__all__ = ["app"]

app = ClientApp(mods=[simulated_faults])
app.train()(train)
app.evaluate()(evaluate)
