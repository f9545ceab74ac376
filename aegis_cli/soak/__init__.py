"""``aegis scan --soak DURATION``: a checked burn-in (docs/soak.md), a job over devices beside
``scan``. ``run.py`` holds the loop (``run_soak``, ``soak_device``, ``SoakOptions``) and the
schedule of input sets; ``record.py`` what the burn-in reports (the ``soak`` section of a device
report) and ``parse_duration``. Importing this package imports neither of them (nor torch).
"""
