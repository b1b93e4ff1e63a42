// Moved to core/half.h; this forward goes once every includer names it.
#pragma once
#include "core/half.h"
