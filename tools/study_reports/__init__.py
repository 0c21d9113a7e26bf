"""Study reports over finished run directories (not part of the installed package).

``aggregate.py`` groups runs by config and aggregates seeds (any metric key); ``study_report.py`` is
the routing-stability study (its algorithm names and paper thresholds live here, not in the
library); ``routing_shape_report.py`` is study E1 (routing shapes at tiny width, issue 67);
``report_provenance.py`` records each run's commit and command; ``shaping_report.py``
summarises the shaping arms; ``store.py`` is the study store (each study's runs and their manifests in
``reports/<study>/``, read back by ``tools/regenerate_report.py``). Used by ``tools/compare_runs.py``,
``tools/shaping_study.py``, ``tools/store_runs.py``, ``tools/regenerate_report.py`` and
``tools/agent_report.py``, which put ``tools/`` on the import path by being run as scripts.
"""
