"""Resource probes: pure parsers over a root directory or command output, and ``live`` for the real device.

``_sysfs`` reads files; ``cpu``, ``thermal``, ``battery``, ``jetson``, ``pi`` and
``providers`` parse them; ``live.LiveProbe`` combines them with psutil.
"""
