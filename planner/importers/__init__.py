"""Importers that turn other tools' profiles into pipeplan profiles."""
