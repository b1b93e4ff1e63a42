// The translation unit of libquestkv.so itself: everything the library holds
// comes whole from questkv_runtime and questkv_core (runtime/CMakeLists.txt),
// and cmake/questkv.map decides what it exports.
