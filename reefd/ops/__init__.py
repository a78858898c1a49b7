"""The operator's surface inside the daemon: auth and tokens, metrics, systemd, and small process helpers."""
