# Reading a msgspec Struct's fields (any __slots__ class's) as C: the field's offset
# in the object, learned once from its member descriptor, then one load per read. From
# compiled code ``r.model`` is a type look-up and a descriptor call (~100 instructions).

from cpython.object cimport PyObject

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    int T_OBJECT_EX


cdef inline Py_ssize_t slot_offset(object cls, str name) except -1:
    """Where ``cls``'s field ``name`` is kept in its objects; TypeError unless it is a slot."""
    d = cls.__dict__.get(name)
    if type(d).__name__ != "member_descriptor" or (<PyMemberDescrObject*>d).d_member.type != T_OBJECT_EX:
        raise TypeError(f"{cls.__name__}.{name} is not a slot")
    return (<PyMemberDescrObject*>d).d_member.offset


cdef inline object slot(object obj, Py_ssize_t offset):
    """The field at ``offset`` of ``obj`` (of the class the offset was learned from)."""
    cdef PyObject* v = (<PyObject**>((<char*><PyObject*>obj) + offset))[0]
    if v == NULL:
        raise AttributeError("field not set")
    return <object>v
