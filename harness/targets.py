class TargetError(Exception):
    pass
