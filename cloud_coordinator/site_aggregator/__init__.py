"""Two-level (hierarchical) robust rounds: a site aggregates its devices, the cloud aggregates the sites.

Flower at both levels: the fog runs a SuperLink for its devices (``site_server``
as the ServerApp) and a SuperNode towards the cloud (``bridge`` as the
ClientApp); ``spool`` is the hand-off between the two on the fog host.
"""
