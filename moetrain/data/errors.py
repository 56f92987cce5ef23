"""`DataError`: data that cannot be used as configured (re-exported as `moetrain.data.DataError`). Its
own module so that the dataset modules need not import the package that builds them."""


class DataError(ValueError):
    pass
