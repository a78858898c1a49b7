"""The Tinker training API's state in reefd (torch-free): sessions, models and their trainer processes, samplers,
futures, and the protobuf bodies. The routes are reefd/api/tinker*.py; docs/tinker.md maps Tinker to Reef."""
