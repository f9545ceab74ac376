"""``aegis scan --soak DURATION``: a checked burn-in (docs/soak.md), a job over devices beside
``scan``. ``schedule.py`` says which inputs, scales and repeats each launch sees; ``run.py``
holds the loop (``run_soak``, ``soak_device``, ``SoakOptions``); ``record.py`` what the burn-in
reports (the ``soak`` section of a device report) and ``parse_duration``. Importing this package
imports none of them (nor torch).
"""
