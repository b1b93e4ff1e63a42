// Moved to core/e4m3.h; this forward goes once every includer names it.
#pragma once
#include "core/e4m3.h"
