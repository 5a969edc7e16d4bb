"""The site's half of a two-level round: a ServerApp on the fog's SuperLink that never ends.

``fogline site-aggregator`` submits the user's Flower App to the fog's own
SuperLink with this ServerApp in place of the user's (the user's ClientApp
trains on the site's devices, unchanged). It waits for jobs from the
bridge (``spool``), runs each as one ``RobustStrategy.train_round`` over the
site's authenticated SuperNodes (the site's rule and ``f``: a Byzantine
device is outvoted here and never reaches the WAN), and writes the site
aggregate back with the counts and rejection reasons the cloud reports.
The model stays the user's: arrays keep their names and order.
"""
from __future__ import annotations

import logging
import time

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from cloud_coordinator.layout import MAX_EXAMPLES, check_count
from cloud_coordinator.settings import settings_for
from cloud_coordinator.strategy import CheckpointConfig, RobustStrategy, RoundConfig

from .spool import Outcome, Spool

__all__ = ["IDLE_POLL_S", "MARGIN_S", "SPOOL_DIR", "app", "serve"]

log = logging.getLogger("fogline.site-rounds")
SPOOL_DIR = "spool"
IDLE_POLL_S = 0.1
MARGIN_S = 2.0          # the site answers this long before the cloud's deadline

app = ServerApp()


def serve(grid: Grid, strategy: RobustStrategy, spool: Spool, *, max_jobs: int | None = None) -> int:
    """Run jobs until ``max_jobs`` (None: for ever); returns how many were answered."""
    done = 0
    while max_jobs is None or done < max_jobs:
        job = spool.take()
        if job is None:
            time.sleep(IDLE_POLL_S)
            continue
        t0 = time.monotonic()
        wait = min(strategy.rounds.round_timeout, job.deadline - time.time() - MARGIN_S)
        arrays = ArrayRecord({n: Array(a) for n, a in zip(job.names, job.arrays)})
        try:
            new, metrics, entry = strategy.train_round(grid, job.server_round, arrays,
                                                       ConfigRecord(dict(job.config)), max(wait, 1.0))
        except Exception as exc:  # a bad job is this job's failure; the site keeps serving rounds
            log.exception("site round %d failed", job.server_round)
            new, metrics, entry = None, None, {"skipped": f"{type(exc).__name__}: {exc}"}
        accepted = tuple(entry.get("accepted", ()))
        got = (dict(metrics) if metrics is not None else {}).get("site-examples", 0.0)
        examples = float(got) if isinstance(got, (int, float)) else 0.0
        out = Outcome(job.job_id, job.names,
                      None if new is None else tuple(new[n].numpy() for n in job.names),
                      examples, tuple(entry.get("clients", ())), accepted, dict(entry.get("rejected", {})),
                      str(entry.get("skipped", "")), time.monotonic() - t0)
        spool.finish(out)
        done += 1
        log.info("site round %d: %d/%d accepted%s in %.1f s", job.server_round, len(accepted), len(out.clients),
                 f", rejected {out.rejected}" if out.rejected else "", out.seconds)
    return done


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = settings_for(context.run_config) or settings_for(getattr(grid.run, "override_config", None))
    if settings is None:
        raise SystemExit("the site server runs under fogline site-aggregator (no fogline-settings in the run config)")
    strategy = RobustStrategy(train_metrics_aggr_fn=_site_metrics,
                              rounds=RoundConfig(fraction_evaluate=0.0, max_attempts=1))
    strategy.apply_settings(settings)
    strategy.checkpoints = CheckpointConfig()   # the cloud checkpoints the model; a site round is redone, not resumed
    strategy.release = None
    strategy.summary()
    serve(grid, strategy, Spool(settings.path(SPOOL_DIR)))


def _site_metrics(contents: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Examples behind the site's aggregate (the accepted devices'), for the cloud's example-weighted mean."""
    total = 0.0
    for c in contents:
        for rec in c.metric_records.values():
            if weighted_by_key in rec:
                n = check_count(rec[weighted_by_key], MAX_EXAMPLES)
                total += n if isinstance(n, float) else 0.0
    return MetricRecord({"site-examples": total})
