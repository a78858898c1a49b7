"""HTTP surface of reefd: one module per protocol, plus errors, reports and admin."""
