// Moved to questkv/runtime.h; this forward goes once every includer names it.
#pragma once
#include "questkv/runtime.h"
