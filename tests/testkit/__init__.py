"""Helpers shared by the tests (models, HTTP apps, PD clusters, transfer agents); fixtures live in
conftest.py."""
