"""Reading results: verdict rules, the gate (two results compared), bisect (the release that changed a cell)."""
