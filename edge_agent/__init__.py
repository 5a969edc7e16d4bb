"""The Fogline edge agent: the only Fogline code on a Raspberry Pi, a Jetson or a laptop.

Nothing is imported here so ``python -m edge_agent`` starts fast. Modules:

- core (pure, time passed in): ``advertiser`` (birth/state builders, significant-change
  policy), ``commands`` (deploy verdicts, label/taint parsing), ``stats`` (latency
  p50/p99, passive link estimator), ``readings``, ``simulated`` (device model),
  ``probes.{cpu,thermal,battery,jetson,pi,providers}`` (parsers over a root path).
- shell: ``agent`` (MQTT wiring, epochs, sealed fog STATE, signed commands), ``executor``
  (onnxruntime sessions, bounded queue, forwarding), ``cache`` (artifacts by sha256,
  LRU), ``acks`` (publish->ack timing), ``probes.live``, ``runner``, ``cli``,
  ``credentials`` (the enrolled ``tls/`` and ``fog.json`` in the data dir), ``enrol``
  (the HTTPS enrolment client of docs/security.md).
- ``testing``: a fog-side signer and a tiny two-partition model for tests and demos.
"""
