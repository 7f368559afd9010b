"""Running the matrix: the session behind the pytest hooks (``session``, with its ``items``, ``progress``,
``process`` set-up, ``resume`` and ``version_cells``), the cell runner (``runner``), the forked sandbox with its
timeouts (``sandbox``), the journal (``journal``) and the throughput benchmark (``throughput``)."""
