// Makes the operator library importable as `tabserve._C`. Importing it runs the static
// TORCH_LIBRARY registrations; the module itself has no Python functions (limited-API safe).
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
