"""Library versions: the table of libraries whose versions matter (``libraries``) and the version environments
made from it (``envs``)."""
