"""Every Lightning face of the library: the callback bases, the ledger, the dashboard and the run recorder."""
