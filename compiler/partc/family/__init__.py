"""The family language: safe expressions and the symbolic family declaration with its checks."""
