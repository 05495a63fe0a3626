"""The ``python -m engine`` commands: each module's ``add_parser`` registers its options, ``run`` runs it."""
