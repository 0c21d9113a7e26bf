"""The Hydra configs, shipped inside the package: ``train.py`` and ``config/compose.py`` search
``pkg://gspo_megatron.conf``, so an installed wheel finds them (the repository's ``conf`` is a link here)."""
