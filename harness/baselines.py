class BaselineError(Exception):
    pass
